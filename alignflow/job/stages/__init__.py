"""The stage kinds' worker modules, job side (torch): `alignflow.job.stages.<kind>.run(cfg, inputs, out)`.

What each kind declares (schema, output format, input roles, compose-time checks, ...) lives
with it on the orchestrator side, in `alignflow.orchestrator.kinds.<kind>`; nothing here is imported by the
orchestrator.
"""
