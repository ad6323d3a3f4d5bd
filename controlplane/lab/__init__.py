"""A real vLLM engine on the local machine for tests and experiments: its install script lives in
`scripts/setup-vllm-lab.sh`, the tiny random-weight model it serves in `tiny_model`, and the
process manager in `engine`."""
