"""Shared fixtures: tiny random-weight checkpoints, the embedded SmolLM2 model, tokenizers."""

import os

# Tests run engine child processes beside the test process on 2 cores; OpenMP threads that
# spin while another process holds the other core make tiny-model steps ~30x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fixtures_models import *  # noqa: F403
from fixtures_pooling_server import pooling_server  # noqa: F401  (one server for the run)
from fixtures_threads import *  # noqa: F403
from fixtures_tokenizer import *  # noqa: F403
