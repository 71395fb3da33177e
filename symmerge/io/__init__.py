"""Input and output: HF model folders (validated loading, atomic writing), lazily read safetensors
checkpoints and shard writing, and the ``--data`` formats."""
