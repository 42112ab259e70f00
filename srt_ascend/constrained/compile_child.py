"""The grammar compiler's child process: `python -m srt_ascend.constrained.compile_child R W`
serves CompileLane's jobs over the pipe file descriptors R (jobs in) and W (answers out)."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from srt_ascend.constrained.compile_worker import serve

if __name__ == "__main__":
    jobs, answers = int(sys.argv[1]), int(sys.argv[2])
    serve(Connection(jobs, writable=False), Connection(answers, readable=False))
