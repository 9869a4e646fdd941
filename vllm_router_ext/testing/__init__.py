"""What the product runs besides the plugin: the demo's tiny checkpoint and server, the module
paths vLLM's worker processes import (a gate tap, ``apply_model`` functions), and the compile check.
Test-only helpers live in ``tests/``."""
