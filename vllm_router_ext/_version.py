"""What the package is called and which version it is, in a module of its own so that any module
can read them without importing the package's ``__init__`` (no import circle)."""

__version__ = "0.1.0"

#: The name vLLM's ``VLLM_PLUGINS`` takes for this plugin (its ``vllm.general_plugins`` entry point).
ENTRY_POINT = "router_ext"
