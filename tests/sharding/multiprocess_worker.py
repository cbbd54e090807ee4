"""One process of a multi-process training test: `python -m tests.sharding.multiprocess_worker '<json spec>'`.

spec: {"address": "localhost:PORT" or null, "num_processes": N, "process_id": i, "config": "configs/moc.py:tiny",
"overrides": {...}, "workdir": DIR, "out": FILE}. Joins the cluster (no address: a plain single process), trains
with the real loop, and writes to `out` what the test checks: the process's place in the cluster and the
batches its data iterator produced (shapes and token ids), plus the loop's last metrics row.
"""
import json
import logging
import sys


def main(spec):
  logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
  from moc_jax import distributed
  distributed.initialize(spec["address"], spec["num_processes"], spec["process_id"])

  import grain
  import jax
  import numpy as np

  import moc_jax
  from moc_jax import data as data_lib
  from moc_jax.train import peaks
  from moc_jax.main import train

  make_train_iterator = data_lib.make_train_iterator
  seen = {"iterator_args": [], "batches": []}

  def recording_iterator(config_data, **kwargs):
    seen["iterator_args"].append({"batch_size": config_data.batch_size, **kwargs})
    it = make_train_iterator(config_data, **kwargs)

    class Recorder(grain.DatasetIterator):  # a DatasetIterator, so grain's checkpoint handler saves its state
      def __next__(self):
        batch = next(self._parent)
        seen["batches"].append(np.asarray(batch["input_ids"]).tolist())
        return batch

      def get_state(self):
        return self._parent.get_state()

      def set_state(self, state):
        self._parent.set_state(state)

    return Recorder(it)

  data_lib.make_train_iterator = recording_iterator
  # No MFU: measuring the CPU peak costs ~15 s and both processes would race on its shared cache file.
  peaks.device_peak_flops = lambda dtype="bfloat16": (None, "not measured in this test")
  config = moc_jax.load_config(spec["config"], spec["overrides"])
  last = train(config, spec["workdir"])
  out = {"process_index": jax.process_index(), "process_count": jax.process_count(),
         "local_devices": jax.local_device_count(), "devices": jax.device_count(),
         "last": {k: float(v) for k, v in last.items()}, **seen}
  with open(spec["out"], "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
