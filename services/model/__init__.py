"""The hybrid model engine: configs, layers, the LM, its request cache, KV export and generation.

Modules: `config` (families, sizes, KV byte accounting, FLOPs; torch-free), the layers
(`kda`, `gated_deltanet` over `delta_core`; `mla`, `gqa`, `swa` over `attention`; `ffn`,
`norm`, `rope`), `model` (the LM, `build_model`), `cache` (per-request KV, state
snapshots), `export` (the wire format of KV pieces, import), `generate` (prefill,
one-request generation), `batch` (continuous-batching decode), `sampling`, `kv_replay`
(decode from exported KV in another process). The package root imports nothing, so light
modules (the tokenizer, the config) stay cheap to import.
"""
