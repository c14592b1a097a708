"""The job side: what computes a stage's output inside its job (torch, Megatron-Core); never
imports prefect. A stage's code identity is the job-side modules its kind's module imports.
"""
