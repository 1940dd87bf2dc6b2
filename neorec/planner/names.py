"""Names the planner accepts, importable without torch (the command-line parser uses them)."""

PRECISIONS = ("fp32", "fp16", "bf16", "int8")  # int8: a cached tier's row store only
TIERS = ("device", "cached_dram", "dram", "cached_ssd")
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
MODEL_PRESET_NAMES = ("dlrm-criteo-kaggle", "dlrm-criteo-terabyte", "neo-model-a", "neo-model-f", "neo-model-i")
