"""Megatron-Core on the worker side: `runtime` (process groups, seeds), `cpu_shim` (CPU-only
patches), `model` (GPTModel from an HF config). Imports torch and megatron; never prefect."""
