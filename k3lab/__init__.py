"""k3lab: ablation and scaling-law harness for the Kimi K3 architecture."""
