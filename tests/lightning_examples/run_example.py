"""Runs a training script as its author wrote it, under Lightning or under distrain, and records the loss of each
backward pass, per rank: ``EXAMPLE_SCRIPT=... EXAMPLE_OUT=... python run_example.py``.

The script is not edited. Before it runs, torch's generator is seeded (Lightning's examples draw their data and
weights without a seed of their own) and ``torch.Tensor.backward`` is wrapped to note each scalar loss it is called
on; each rank keeps ``EXAMPLE_OUT/losses_rank{rank}.json`` up to date (a launcher may end a rank without running its
exit handlers). The paths come in the environment, not in
``sys.argv``: the script sees a command line of its own, and a launcher that starts the other ranks by running the
command again (Lightning's and distrain's ``ddp``) runs this harness again. The same file serves both frameworks, so the
stored Lightning losses (``reference/``) and distrain's come from one harness."""

import json
import os
import sys
import types

import torch

script, out_dir = os.path.abspath(os.environ["EXAMPLE_SCRIPT"]), os.path.abspath(os.environ["EXAMPLE_OUT"])
losses = []
backward = torch.Tensor.backward


def recording_backward(self, *args, **kwargs):
    if self.dim() == 0:
        losses.append(float(self.detach()))
        os.makedirs(out_dir, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0  # launchers differ in env
        with open(os.path.join(out_dir, f"losses_rank{rank}.json"), "w") as f:
            json.dump(losses, f)
    return backward(self, *args, **kwargs)


torch.Tensor.backward = recording_backward
torch.manual_seed(int(os.environ.get("EXAMPLE_SEED", "0")))
# the script as __main__, as `python SCRIPT` runs it; not runpy.run_path, which points sys.argv[0] at the script, so
# that a launcher starting the other ranks from sys.argv would run the script without this harness
main = types.ModuleType("__main__")
main.__file__ = script
sys.modules["__main__"] = main
with open(script) as f:
    exec(compile(f.read(), script, "exec"), main.__dict__)
