"""The training engine shared by the training stages: data order, batches, the engine's
functions (`engine`), the SFT/DPO loop (`loop`), checkpoints, metrics, workspaces."""
