"""Multi-LoRA serving: PEFT adapters on the base model's linears, many adapters in one batch.

- `request.py`: `LoRARequest` (vLLM's name), what a request carries to name its adapter;
- `config.py`: the engine's LoRA settings (`max_loras`, `max_lora_rank`, `max_cpu_loras`);
- `adapter.py`: reading and checking a PEFT adapter directory;
- `registry.py`: the adapters an engine knows by name (loaded and unloaded at run time);
- `slots.py`: the scheduler's side: which adapter sits in which slot, the LRU of adapters held in
  host memory, the slots pinned by running requests;
- `layer.py`: one linear's stacked slot tensors and its grouped delta;
- `batch.py`: a step's rows grouped by slot, read by every LoRA layer;
- `model_lora.py`: the model runner's side: layers attached, adapters moved into slots.
"""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
