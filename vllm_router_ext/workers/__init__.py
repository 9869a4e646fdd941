"""Modules vLLM's worker processes import by path: the gate tap and the step timer (worker
extensions, ``--worker-extension-cls``) and the functions ``vllm.LLM.apply_model`` runs there."""
