"""optremat inside torch.compile: the plan is the forward/backward partition."""
