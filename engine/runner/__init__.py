"""The runner side of the engine: one step of the model on one worker (inputs, forward,
sampling), the executor interface that runs it, and the KV and device memory it holds."""
