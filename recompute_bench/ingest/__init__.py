"""Readers of other frameworks' arguments, logs and golden files -> this product's configs and records.

`megatron_args` maps Megatron's arguments onto a Config (framework megatron). One reader per file
format (`megatron_log`, `bridge_log`, `torchtitan_log`, `megatron_golden`, `bridge_golden`) fills a
`parsed.ParsedRun`; `formats` picks the reader; `timing` chooses the steps each source's own checks
use; `config` assembles the config a run used; `record` turns a parsed run and its config into a
`recompute-bench/result/v1` record with the estimate beside every measured figure.
"""
