"""`dflash-trt bench`: single-stream speed per prompt category, throughput-versus-interactivity sweeps
against any OpenAI-compatible endpoint, and Pareto plots."""
