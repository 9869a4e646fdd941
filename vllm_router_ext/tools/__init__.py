"""Commands that ship with the plugin: the demo (a tiny DeepSeek-V3 served with
``--router-precision``), the ``vllm serve`` runner it uses, the tiny-checkpoint builder, an offline
``vllm.LLM`` run, and the compile check of every kernel for a GPU architecture."""
