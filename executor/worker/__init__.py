"""The executor's model side: weights, the paged KV cache tensors, the forward
pass and sampling, behind a worker group the engine drives with plain data
(``SchedulerOutput`` in, ``ModelRunnerOutput`` out)."""
