"""One rank of the multi-node test (tests/py/test_multinode.py): reads EPOCHS epochs of
rows.npy through its node's mount with a node-partitioned Loader and saves the row ids it got,
one array per epoch, to OUT.npz. Arguments: MOUNT RANK WORLD LOCAL EXCHANGE EPOCHS OUT."""

import sys

import numpy as np

import stagefs


def main() -> None:
    mount, rank, world, local, exchange, epochs, out = sys.argv[1:8]
    loader = stagefs.Loader(f"{mount}/rows.npy", 64, shuffle=True, seed=5, tensors="numpy",
                            readers=2, rank=int(rank), world_size=int(world),
                            local_world_size=int(local), partition="node",
                            exchange=float(exchange))
    got = {}
    for epoch in range(int(epochs)):
        loader.set_epoch(epoch)
        got[f"e{epoch}"] = np.concatenate([batch[0][:, 0].copy() for batch in loader])
    loader.close()
    np.savez(out, **got)


if __name__ == "__main__":
    main()
