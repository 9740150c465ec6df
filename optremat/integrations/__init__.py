"""optremat where training libraries already have a checkpointing switch."""
