"""Generation engines a job runs beside its ranks: vLLM's server (`vllm_server`, in alignflow's
environment) and what runs inside it (`vllm_side`, in the engine's own environment)."""
