"""Training-framework callbacks: `hookstats.integrations.transformers.HookstatsCallback` (a Hugging Face
`TrainerCallback`) and `hookstats.integrations.lightning.HookstatsCallback` (a Lightning `Callback`). Each module
imports its framework; this package imports neither, and `import hookstats` does not import it."""
