"""The orchestrator side: what the flow and the CLI run to decide what runs, where and whether.

It imports no torch, megatron or prefect; from the job side only torch-free declarations (the
family table, data formats, reward names), to refuse bad config before any job. Jobs import its
contract: the config schema, the store, leases, the output checks. None of it is part of a
stage's code identity (`fingerprint`).
"""
