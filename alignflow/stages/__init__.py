"""The stage kinds' worker modules, job side (torch): `alignflow.stages.<kind>.run(cfg, inputs, out)`.

What each kind declares (schema, output format, input roles, compose-time checks, ...) lives
with it on the orchestrator side, in `alignflow.kinds.<kind>`; nothing here is imported by the
orchestrator.
"""
