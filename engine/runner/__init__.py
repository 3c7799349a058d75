"""Running a step: the model runner (KV cache, inputs, forward, CUDA graphs), the sampler and
prompt logprobs, and the CPU's memory kept between steps."""
