"""LoRA adapters (`LLM(path, enable_lora=True, max_loras=, max_lora_rank=)`, vLLM's API): many
PEFT fine-tunes of one base model, each request naming its own (`lora_request=`), all in one step.
Imported only with enable_lora, but for request.py's LoRARequest.

    request.py     LoRARequest(lora_name, lora_int_id, lora_path)
    checkpoint.py  a PEFT checkpoint read and checked; the scale folded into B
    layers.py      a target projection's LoRA layer: its own GEMM plus each row's adapter
    ops.py         the adapters' GEMMs batched by slot (a hot op: CUDA's is kernels/lora.py)
    mapping.py     which slot each row of a step runs under (carried in its ForwardContext)
    manager.py     the runner's adapters and max_loras slots, least recently used given up first
    scheduling.py  the scheduler admits a request only while its adapter can have a slot

Prefix caching keeps each adapter's KV apart: a sequence's adapter salts its first block's hash
(core/block_manager.py)."""
