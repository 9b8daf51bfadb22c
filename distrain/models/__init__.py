from distrain.models.gpt import GPT, GPTConfig, Block, GPT_SIZES

__all__ = ["GPT", "GPTConfig", "Block", "GPT_SIZES"]
