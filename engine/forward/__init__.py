"""What one forward pass reads beside its tensors: the step's context (positions, slots, KV
layout), the kernels chosen once at start-up, and the LoRA metas of the step."""
