"""Plans for a model: `plan()` (model), the `Plan` it returns and its file (result), plans
for the native runtime (native), plans run op by op (ops), and the plan cache (cache)."""
