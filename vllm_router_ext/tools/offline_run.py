"""Run one offline ``vllm.LLM`` scenario and save what the gates did, for the tests. It ships
because the tests run it as ``python -m`` in a fresh interpreter, whose vLLM workers import
:mod:`gate_records` by module path.

    python -m vllm_router_ext.tools.offline_run MODEL_DIR OUT.pt [--additional-config JSON]
        [--tp N] [--hf-overrides JSON] [--max-tokens N] [--speculative-config JSON]

Saves ``{"texts", "gates": [per-rank gate summaries], "records": [rank-0 gate/router records]}``;
with a speculative config also ``"draft_gates"`` and ``"draft_records"`` (the draft model's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Path",
    "for i in range(10):",
    "    return self._data[key]",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--additional-config", default="{}")
    p.add_argument("--hf-overrides", default="{}")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (vLLM's default)")
    p.add_argument("--speculative-config", default=None, help="e.g. an MTP draft (JSON)")
    p.add_argument("--load-format", default="auto", help="vLLM's --load-format (dummy: random weights)")
    args = p.parse_args(argv)

    import torch
    from vllm import LLM, SamplingParams

    from vllm_router_ext.workers import gate_records

    llm = LLM(
        model=args.model,
        enforce_eager=not args.compile,
        max_model_len=256,
        dtype="bfloat16",
        tensor_parallel_size=args.tp,
        additional_config=json.loads(args.additional_config),
        hf_overrides=json.loads(args.hf_overrides),
        seed=0,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        load_format=args.load_format,
    )
    draft = args.speculative_config is not None
    gates = llm.apply_model(gate_records.gate_summary)
    llm.apply_model(gate_records.install_gate_recorders)
    saved = {"gates": gates}
    if draft:
        saved["draft_gates"] = llm.collective_rpc(gate_records.draft_gate_summary)
        llm.collective_rpc(gate_records.install_draft_gate_recorders)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    saved["texts"] = [o.outputs[0].text for o in outs]
    saved["records"] = llm.apply_model(gate_records.collect_gate_records)[0]
    if draft:
        saved["draft_records"] = llm.collective_rpc(gate_records.collect_draft_gate_records)[0]
    torch.save(saved, args.out)
    # Stop the engine (and its workers) now, then skip interpreter teardown: with TP=2 on the CPU,
    # a C++ thread left in this process once aborted teardown after a complete run ("terminate called
    # without an active exception", exit -6, CI 2026-11-30); everything the tests read is saved.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
