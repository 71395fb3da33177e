"""fedvit: small ViTs trained federatedly on Fashion-MNIST shards, aggregated by symmerge's AlignedFedAvg."""
