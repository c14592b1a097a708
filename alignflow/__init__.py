"""alignflow: multi-stage LLM alignment pipelines.

Light parts (config, store, launch, the stage kinds in `alignflow.orchestrator.kinds`) import no torch; the worker side
(`alignflow.job.stages.*`, `alignflow.job.data`) runs inside jobs and never imports prefect.
"""

from pathlib import Path

__version__ = "0.1.0"

PROJECT_ROOT = Path(__file__).resolve().parent.parent
