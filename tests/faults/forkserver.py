"""A fork server for crash campaigns: import the trainer once, fork one training process per request.

Starting Python, torch and transformers takes most of a short run's time on a busy 2-core machine;
forking a process that has already imported them (and has computed nothing, so no thread pool
exists to break across the fork) makes each attempt of a campaign cost its training time only. The
forked process runs the real command line (``tearless train …``) and is killed with a real SIGKILL.

Protocol, one JSON object per line: request ``{"args": [...], "fault": str | null, "stderr": path,
"fsize": bytes | null}`` (``fsize``: RLIMIT_FSIZE for the training process)
on stdin; answers ``{"pid": N}`` when the training process starts and ``{"status": code}`` (as
``subprocess`` reports it: negative for a signal) when it ends.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import traceback

import transformers.models.llama.modeling_llama  # noqa: F401  (imported lazily by from_pretrained)
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

import tearless.rewards.registry
import tearless.trainers.rl  # noqa: F401
from tearless.cli import main as cli_main
from tearless.faults import ENV


def _child(request: dict) -> int:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    if request.get("fsize"):
        # A real write failure: past this many bytes a write fails with EFBIG (SIGXFSZ ignored, as
        # a full disk's writes fail with ENOSPC instead of killing the writer).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
    os.environ.pop(ENV, None)
    if request.get("fault"):
        os.environ[ENV] = request["fault"]
    try:
        return cli_main(["train", *request["args"]])
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
