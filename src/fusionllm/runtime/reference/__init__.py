"""Single-process trainers and checks: the references every distributed run is compared with."""
