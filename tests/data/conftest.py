"""The small moc_facts corpus the pipeline tests read (built once per module)."""
import pytest

from moc_jax.config import data_config
from moc_jax.data.facts import facts_builder

FACTS = {"num_entities": 40, "num_docs": 300, "num_val_docs": 30}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("data"))
  c = data_config()
  c.facts.update(FACTS)
  facts_builder(c.facts, root)
  return root
