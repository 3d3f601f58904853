"""`python -m distrib_tf.data prepare`: write a registered dataset as shards for the main job."""

import sys

import distrib_tf
from distrib_tf import argparsing
from distrib_tf import exit_codes
from distrib_tf.data.pipeline import DATASETS
from distrib_tf.data.pipeline import write_tfrecords


def main(argv=None) -> int:
    """`python -m distrib_tf.data prepare --dataset=NAME --out=DIR [--num_shards=N] [--data_dir=DIR]`."""
    distrib_tf.log_to_stderr()

    parser = argparsing.Parser(prog="python -m distrib_tf.data", description="Prepare datasets.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=argparsing.Parser)
    prepare = commands.add_parser("prepare", help="write a dataset as TFRecord shards")
    prepare.add_argument("--dataset", required=True, help="a registered dataset: " + ", ".join(DATASETS))
    prepare.add_argument("--out", required=True, help="the directory to write the shards and dataset.json to")
    prepare.add_argument("--num_shards", type=int, default=8, help="files per split")
    prepare.add_argument("--data_dir", default=None, help="where a TFDS dataset was prepared")
    args = parser.parse_args(argv)
    try:
        info = write_tfrecords(args.dataset, args.out, num_shards=args.num_shards, data_dir=args.data_dir)
    except (ValueError, OSError) as e:
        print(f"distrib_tf.data: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    print(f"Wrote {info.num_examples} examples of {args.dataset} to {args.out} in "
          f"{args.num_shards} files per split; use --dataset=tfrecord:{args.out}")
    return exit_codes.OK

