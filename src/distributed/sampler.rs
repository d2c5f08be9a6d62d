//! Each rank's share of an epoch, as PyTorch's `DistributedSampler`.

use crate::{Error, Result};

/// Splits every epoch's sample order between `world_size` ranks: the order (the loader's
/// seeded permutation, the same on every rank) is padded by repeating its first samples to a
/// multiple of the world size, or cut to one with `drop_last`, and rank `r` takes samples
/// `r, r + world_size, ...`. The ranks' shards together are the epoch of one process (plus
/// the padding). Set it as [`crate::data::DataLoaderConfig::sampler`]; the epoch number the
/// loader is given reshuffles (no `set_epoch` to forget).
///
/// ```
/// use mantissa::distributed::DistributedSampler;
/// let s = DistributedSampler::new(1, 2)?;
/// assert_eq!(s.shard(&[4, 0, 3, 1, 2])?, vec![0, 1, 4]);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DistributedSampler {
    pub rank: usize,
    pub world_size: usize,
    /// Drop the tail that does not fill every rank, instead of padding.
    pub drop_last: bool,
}

impl DistributedSampler {
    /// Rank `rank`'s shard of `world_size`, padding the last round.
    pub fn new(rank: usize, world_size: usize) -> Result<DistributedSampler> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(
                "DistributedSampler",
                format!("rank {rank} is not a rank of a world of {world_size}"),
            ));
        }
        Ok(DistributedSampler {
            rank,
            world_size,
            drop_last: false,
        })
    }

    /// The shard for `process`'s rank: [`crate::distributed::ProcessGroup`]'s.
    pub fn for_group(process: &super::ProcessGroup) -> DistributedSampler {
        DistributedSampler {
            rank: process.rank(),
            world_size: process.world_size(),
            drop_last: false,
        }
    }

    /// How many samples each rank gets of `n`.
    pub fn num_samples(&self, n: usize) -> usize {
        match self.drop_last {
            true => n / self.world_size,
            false => n.div_ceil(self.world_size),
        }
    }

    /// This rank's samples of an epoch whose order is `order`.
    pub fn shard(&self, order: &[usize]) -> Result<Vec<usize>> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid(
                "DistributedSampler",
                format!(
                    "rank {} is not a rank of a world of {}",
                    self.rank, self.world_size
                ),
            ));
        }
        let per = self.num_samples(order.len());
        if per > 0 && order.is_empty() {
            return Ok(Vec::new());
        }
        Ok((0..per)
            .map(|k| order[(k * self.world_size + self.rank) % order.len()])
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_epoch_as_pytorch() {
        let order: Vec<usize> = (0..10).rev().collect();
        for world in 1..5 {
            let mut union: Vec<usize> = Vec::new();
            for r in 0..world {
                let s = DistributedSampler::new(r, world)
                    .unwrap()
                    .shard(&order)
                    .unwrap();
                assert_eq!(s.len(), 10usize.div_ceil(world));
                union.extend(s);
            }
            // Padding repeats the first samples of the order: PyTorch's
            // `indices += indices[:padding]`.
            let pad = union.len() - 10;
            let mut want: Vec<usize> = order.clone();
            want.extend(&order[..pad]);
            union.sort();
            want.sort();
            assert_eq!(union, want, "world {world}");
        }
        let mut s = DistributedSampler::new(2, 3).unwrap();
        s.drop_last = true;
        assert_eq!(s.shard(&order).unwrap(), vec![7, 4, 1]);
        assert!(DistributedSampler::new(3, 3).is_err());
    }

    #[test]
    fn loaders_of_two_ranks_split_each_shuffled_epoch() {
        use crate::data::{DataLoader, DataLoaderConfig, TensorDataset};
        use crate::{DType, Device, Tensor};
        use std::sync::Arc;
        let x = Tensor::zeros(&[11, 2], DType::F32, Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..11i64).collect(), &[11], Device::Cpu).unwrap();
        let data = Arc::new(TensorDataset::new(&x, &y).unwrap());
        let labels = |rank: usize, epoch: usize| -> (usize, Vec<i64>) {
            let cfg = DataLoaderConfig {
                shuffle: true,
                seed: 7,
                sampler: Some(DistributedSampler::new(rank, 2).unwrap()),
                ..DataLoaderConfig::new(4)
            };
            let mut dl = DataLoader::new(data.clone(), cfg).unwrap();
            let n = dl.len();
            let ys = dl
                .epoch(epoch)
                .flat_map(|b| b.unwrap().y.to_vec::<i64>().unwrap())
                .collect();
            (n, ys)
        };
        for epoch in 0..2 {
            let ((n0, a), (n1, b)) = (labels(0, epoch), labels(1, epoch));
            // 11 samples, 6 each (one padded), 2 batches each: the ranks step together.
            assert_eq!((n0, n1, a.len(), b.len()), (2, 2, 6, 6));
            let mut all: Vec<i64> = a.iter().chain(&b).copied().collect();
            all.sort();
            all.dedup();
            assert_eq!(
                all,
                (0..11).collect::<Vec<i64>>(),
                "epoch {epoch}: the union is the epoch"
            );
        }
        // Another epoch, another order.
        assert_ne!(labels(0, 0).1, labels(0, 1).1);
    }
}
