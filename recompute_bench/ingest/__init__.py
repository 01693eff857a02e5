"""Runs measured elsewhere, as records of this product: readers of Megatron-LM and Megatron Bridge
training logs, torchtitan logs, and Megatron-LM's and Bridge's golden-value files.

One reader per format (`megatron_log`, `bridge_log`, `torchtitan_log`, `megatron_golden`,
`bridge_golden`) fills a `parsed.ParsedRun`; `formats` picks the reader; `timing` chooses the steps
each source's own checks use; `record` turns a parsed run and its config into a
`recompute-bench/result/v1` record with the estimate beside every measured figure.
"""
