"""The built-in demo and what it needs: real data sets fetched from package registries, reproducible
cached training of small ViTs, the real offline model assets. Not needed by the library itself."""
