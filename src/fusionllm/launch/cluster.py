"""``fusionllm.Cluster``: a cluster file (sites, devices, links) as an object a script passes around.

    cluster = fusionllm.Cluster.from_file("examples/clusters/three-sites.toml")
    cluster.num_devices, cluster.name
    fusionllm.train(cluster=cluster, ...)   # an emulated testbed of it (as `train --cluster FILE.toml`)

A cluster made from text (``from_toml``) has no file; a run writes the text into its run directory
and starts the testbed from there, so the coordinator reads the same file a command line gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fusionllm.cluster.sites import ClusterSpec
from fusionllm.cluster.spec import load_cluster, parse_cluster


@dataclass(frozen=True)
class Cluster:
    """A parsed cluster file: ``spec`` (checked when read), its TOML ``text`` and ``path`` (None when
    made from text)."""

    spec: ClusterSpec
    text: str
    path: Path | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """Read and check a cluster file (a bad one raises ``ConfigError`` naming the key)."""
        path = Path(path)
        spec = load_cluster(path)
        return cls(spec, path.read_text(), path.resolve())

    @classmethod
    def from_toml(cls, text: str, name: str = "cluster") -> Cluster:
        """A cluster from the text of a cluster file."""
        return cls(parse_cluster(text, f"<{name}>"), text)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_devices(self) -> int:
        return self.spec.num_devices

    def file_in(self, run_dir: Path) -> Path:
        """The cluster file a run starts from: this one's path, or its text written into ``run_dir``."""
        if self.path is not None:
            return self.path
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "cluster.toml"
        path.write_text(self.text)
        return path.resolve()

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, {self.num_devices} devices" + (f", {str(self.path)!r})" if self.path else ")")
