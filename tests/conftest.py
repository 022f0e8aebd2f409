"""Shared fixtures: tiny random-weight checkpoints, the embedded SmolLM2 model, tokenizers."""

import os

# Tests run on 2 cores shared with engine child processes: keep torch from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from fixtures_models import *  # noqa: E402,F403
from fixtures_tokenizer import *  # noqa: E402,F403
