"""The same job on an engine people already run: Kubernetes (`kubernetes`) and Slurm (`slurm`).

`distrib-tf-export` (`distrib_tf.deploy.cli`) writes their files. No TensorFlow here.
"""
