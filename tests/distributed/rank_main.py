"""One rank of a distributed test: `python -m tests.distributed.rank_main '<json args>'`.

Joins the gloo group, builds its part of the tiny model from the full safetensors weights, runs
tiny_llama.run_steps and writes, under args["out_dir"]: rank{r}.json (its layer range and the
bytes of its TP-split weights) and, on the last pipeline stage, logits_rank{r}.npy.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

from pagedserve.distributed.parallel_state import (
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from tests.distributed.tiny_llama import build_model, run_steps, sharded_weight_bytes, tiny_config


def main(args: dict) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    rank, tp, pp = args["rank"], args["tp"], args["pp"]
    init_distributed_environment(tp * pp, rank, args["init_method"], "gloo",
                                 timeout_s=args["timeout_s"])
    try:
        initialize_model_parallel(tp, pp)
        model = build_model(tiny_config(args["architecture"]), load_file(args["weights_path"]))
        logits = run_steps(model)
        out_dir = args["out_dir"]
        if logits is not None:
            np.save(os.path.join(out_dir, f"logits_rank{rank}.npy"), logits)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"start_layer": model.start_layer, "end_layer": model.end_layer,
                       "sharded_weight_bytes": sharded_weight_bytes(model)}, f)
    finally:
        destroy_model_parallel()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
