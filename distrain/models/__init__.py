from distrain.models.gpt import GPT, GPT_SIZES, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "GPT_SIZES"]
