"""Checkpoint files: streaming HF safetensors (`safetensors_io`) and Megatron torch_dist
(`dist_io`), plus the layout every model-producing stage's output shares:

    {out}/model/       the torch_dist checkpoint (global tensors, any TP/PP loads it)
    {out}/hf/          config.json and generation_config.json of the HF model it came from
    {out}/tokenizer/   the tokenizer files
"""

MODEL_DIR = "model"
HF_DIR = "hf"
TOKENIZER_DIR = "tokenizer"
HF_CONFIG_FILES = ("config.json", "generation_config.json")
