"""Train with a YAML config: `accelerate launch scripts/train.py --config configs/quickstart.yaml [--key value ...]`.

The same as `trl-aspo train`, for launchers that want a script path."""

from trl_aspo.cli.train import main

if __name__ == "__main__":
    main()
