from model.gpt import GPT, GPTConfig, flops_per_iteration, num_parameters

__all__ = ["GPT", "GPTConfig", "num_parameters", "flops_per_iteration"]
