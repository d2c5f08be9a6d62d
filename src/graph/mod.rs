//! CUDA graphs: a whole training step (forward, backward, unscale and finite check,
//! clipping, optimizer and scaler update) captured once and replayed with one launch.
//!
//! [`CapturedStep`] wraps a closure over the step's inputs. Its first calls run the step
//! eagerly (warm-up: cuDNN's benchmark, lazily created optimizer states and scaler, kernel
//! loading); the next one copies the batch into static input tensors, captures the step on
//! them and replays it; every later call copies its batch into those inputs and replays. A
//! batch of another shape, dtype or device, or a watched tensor replaced (see
//! [`CapturedStep::watch`]), warms up and captures again; a stale graph is never replayed.
//!
//! What a replay reads at run time rather than frozen at capture: the generators the step
//! draws from (dropout, SGLD: each replay draws new numbers, as the eager step would), the
//! learning rate of every optimizer ([`crate::optim::Optimizer::set_lr`], schedules included),
//! and the scaler's scale and the optimizers' step counts, which live on the device anyway.
//! So N replays give the same tensors, bit for bit, as N eager steps.
//!
//! Refused inside a captured step, with [`crate::Error::NotCapturable`] naming the op: a read
//! into host memory (`item()`, `to_vec`, a host fallback, an op whose output shape depends on
//! data), an upload from host memory, a draw from a plain [`crate::Generator`] value, and
//! anything that would synchronise the device. One thread drives the device while a step is
//! captured. The outputs of a replayed step are the same tensors each time, overwritten by
//! the next replay (copy one to keep it). The step's host code runs at warm-up and capture
//! only: what it decides on the host (a counter, a learning rate computed inside it) is
//! frozen in the graph; set learning rates with `set_lr` between calls.
//!
//! [`StepGraph`] is the same without owning the closure: the step is passed at each call, for
//! a loop that also uses its model, optimizer and scaler between steps (the examples'
//! `--cuda-graph`).
//!
//! ```no_run
//! use mantissa::{graph::CapturedStep, nn::{Linear, Module}, optim::{Optimizer, Sgd, SgdConfig}};
//! use mantissa::{DType, Device, Generator, Tensor};
//! let dev = Device::Cuda(0);
//! let mut model = Linear::new(8, 2, true, &mut Generator::new(0))?;
//! model.to_device(dev)?;
//! let mut opt = Sgd::new(model.parameters(), SgdConfig::new(0.1))?;
//! let mut step = CapturedStep::new(dev, move |b: &[Tensor]| {
//!     opt.zero_grad();
//!     let loss = model.forward(&b[0])?.sub(&b[1])?.sqr()?.mean_all()?;
//!     loss.backward()?;
//!     opt.step()?;
//!     Ok(vec![loss])
//! })?;
//! for _ in 0..10 {
//!     let x = Tensor::randn(&[32, 8], DType::F32, dev)?;
//!     let y = Tensor::randn(&[32, 2], DType::F32, dev)?;
//!     let loss = step.run(&[x, y])?;
//!     println!("{}", loss[0].item()?);
//! }
//! # Ok::<(), mantissa::Error>(())
//! ```

#[cfg(feature = "cuda-backend")]
use crate::capture as scope;

use crate::{DType, Device, Error, MemoryFormat, Result, Tensor};

#[cfg(feature = "cuda-backend")]
use crate::backend::cuda::graph::DeviceGraph;

/// What a graph was captured for: each input's shape, dtype, device and memory format, and
/// each watched tensor's storage, shape and dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    inputs: Vec<(Vec<usize>, DType, Device, MemoryFormat)>,
    watched: Vec<(usize, Vec<usize>, DType)>,
}

/// A training step captured as a CUDA graph and replayed (see the [module](self)), the step
/// given as a closure it owns.
pub struct CapturedStep<F> {
    step: F,
    graph: StepGraph,
}

impl<F> CapturedStep<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    /// A step on CUDA device `device`, with three warm-up calls (as PyTorch's
    /// `make_graphed_callables`). Errors on a device that is not CUDA or not available.
    pub fn new(device: Device, step: F) -> Result<CapturedStep<F>> {
        Ok(CapturedStep {
            step,
            graph: StepGraph::new(device)?,
        })
    }

    /// Eager calls before each capture (at least 1: lazily created state must exist first).
    pub fn with_warmup(mut self, calls: usize) -> CapturedStep<F> {
        self.graph = self.graph.with_warmup(calls);
        self
    }

    /// See [`StepGraph::watch`].
    pub fn watch(mut self, tensors: &[Tensor]) -> CapturedStep<F> {
        self.graph = self.graph.watch(tensors);
        self
    }

    /// Runs the step on `batch`: eagerly during warm-up, else by replaying the graph
    /// (captured first when there is none for this batch's signature). Returns the step's
    /// outputs; a replay's are the graph's own tensors, overwritten by the next replay.
    pub fn run(&mut self, batch: &[Tensor]) -> Result<Vec<Tensor>> {
        self.graph.run(batch, &mut self.step)
    }

    /// Runs the step eagerly on `batch`, neither capturing nor replaying (an evaluation
    /// pass, a short last batch, or a reference run to compare a replay with).
    pub fn run_eagerly(&mut self, batch: &[Tensor]) -> Result<Vec<Tensor>> {
        (self.step)(batch)
    }

    /// The graph and its counters.
    pub fn graph(&self) -> &StepGraph {
        &self.graph
    }

    /// Graphs captured so far.
    pub fn captures(&self) -> usize {
        self.graph.captures
    }

    /// Replays so far.
    pub fn replays(&self) -> usize {
        self.graph.replays
    }

    /// See [`StepGraph::graph_size`].
    pub fn graph_size(&self) -> (u32, u32) {
        self.graph.graph_size()
    }
}

/// The graph of a training step, the step given at each call ([`StepGraph::run`]): for a
/// loop whose model, optimizer and scaler are also used between steps (learning rates set,
/// evaluation, checkpoints), where a closure owning them would be in the way. The step passed
/// must be the same at every call: it runs only for warm-up and capture.
pub struct StepGraph {
    device: Device,
    warmup: usize,
    /// Eager calls left before the next capture.
    eager_left: usize,
    watched: Vec<Tensor>,
    signature: Option<Signature>,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    #[cfg(feature = "cuda-backend")]
    graph: Option<(DeviceGraph, scope::Prologue)>,
    captures: usize,
    replays: usize,
}

impl StepGraph {
    /// A graph for steps on CUDA device `device`, with three warm-up calls. Errors on a
    /// device that is not CUDA or not available.
    pub fn new(device: Device) -> Result<StepGraph> {
        if !matches!(device, Device::Cuda(_)) {
            return Err(Error::invalid(
                "CapturedStep::new",
                format!("CUDA graphs need a CUDA device, got {device}"),
            ));
        }
        device.check_available()?;
        Ok(StepGraph {
            device,
            warmup: 3,
            eager_left: 3,
            watched: Vec::new(),
            signature: None,
            inputs: Vec::new(),
            outputs: Vec::new(),
            #[cfg(feature = "cuda-backend")]
            graph: None,
            captures: 0,
            replays: 0,
        })
    }

    /// Eager calls before each capture (at least 1: lazily created state must exist first).
    pub fn with_warmup(mut self, calls: usize) -> StepGraph {
        self.warmup = calls.max(1);
        self.eager_left = self.warmup;
        self
    }

    /// Tensors whose storage the graph reads or writes in place (the parameters, say): when
    /// one of them is replaced by another storage, shape or dtype (a module rebuilt, moved,
    /// or loaded into new tensors), the next call captures again instead of replaying into
    /// the old storage.
    pub fn watch(mut self, tensors: &[Tensor]) -> StepGraph {
        self.watched = tensors.to_vec();
        self
    }

    /// Graphs captured so far.
    pub fn captures(&self) -> usize {
        self.captures
    }

    /// Replays so far.
    pub fn replays(&self) -> usize {
        self.replays
    }

    /// The static inputs a replay reads, each batch copied into them (empty before the first
    /// capture).
    pub fn inputs(&self) -> &[Tensor] {
        &self.inputs
    }

    /// Kernel launches and library calls one replay runs (0s before the first capture).
    pub fn graph_size(&self) -> (u32, u32) {
        #[cfg(feature = "cuda-backend")]
        if let Some((g, _)) = &self.graph {
            return g.counts();
        }
        (0, 0)
    }

    /// Runs `step` on `batch` during warm-up, else replays its graph (captured first when
    /// there is none for this batch's signature). Returns the step's outputs; a replay's are
    /// the graph's own tensors, overwritten by the next replay.
    pub fn run(
        &mut self,
        batch: &[Tensor],
        step: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let sig = self.signature_of(batch)?;
        if self.signature.as_ref() != Some(&sig) {
            self.drop_graph();
            self.signature = Some(sig);
            self.eager_left = self.warmup;
        }
        if self.eager_left > 0 {
            self.eager_left -= 1;
            return step(batch);
        }
        self.replay(batch, step)
    }

    fn signature_of(&self, batch: &[Tensor]) -> Result<Signature> {
        if let Some(t) = batch.iter().find(|t| t.device() != self.device) {
            return Err(Error::DeviceMismatch {
                op: "CapturedStep::run",
                lhs: self.device,
                rhs: t.device(),
            });
        }
        Ok(Signature {
            inputs: batch
                .iter()
                .map(|t| (t.shape().to_vec(), t.dtype(), t.device(), t.memory_format()))
                .collect(),
            watched: self
                .watched
                .iter()
                .map(|t| (t.storage_addr(), t.shape().to_vec(), t.dtype()))
                .collect(),
        })
    }

    fn drop_graph(&mut self) {
        #[cfg(feature = "cuda-backend")]
        {
            self.graph = None;
        }
        self.outputs.clear();
        self.inputs.clear();
    }

    #[cfg(not(feature = "cuda-backend"))]
    fn replay(
        &mut self,
        _batch: &[Tensor],
        _step: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        Err(Error::CudaUnavailable {
            device: self.device,
            reason: "this build has no CUDA backend".into(),
        })
    }

    #[cfg(feature = "cuda-backend")]
    fn replay(
        &mut self,
        batch: &[Tensor],
        step: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let stale = self
            .graph
            .as_ref()
            .and_then(|(_, p)| p.stale().map(str::to_string));
        if let Some(what) = stale {
            log::info!("CapturedStep: {what} changed since the capture; capturing again");
            self.graph = None;
        }
        if self.graph.is_none() {
            self.capture(batch, step)?;
        } else {
            crate::no_grad(|| -> Result<()> {
                for (dst, src) in self.inputs.iter().zip(batch) {
                    dst.copy_(src)?;
                }
                Ok(())
            })?;
        }
        let (graph, prologue) = self.graph.as_ref().expect("captured above");
        graph.launch(&prologue.fill()?)?;
        self.replays += 1;
        Ok(self.outputs.clone())
    }

    /// Captures the step on static copies of `batch`.
    #[cfg(feature = "cuda-backend")]
    fn capture(
        &mut self,
        batch: &[Tensor],
        step: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<()> {
        let Device::Cuda(ordinal) = self.device else {
            unreachable!("checked in new")
        };
        let rt = crate::backend::cuda::runtime::runtime(ordinal)?;
        // Static copies in the batch's memory format (a channels-last batch stays NHWC, so
        // the captured step takes the eager one's paths).
        let inputs = crate::no_grad(|| {
            batch
                .iter()
                .map(|t| t.copy()?.to_memory_format(t.memory_format()))
                .collect::<Result<Vec<_>>>()
        })?;
        let (graph, prologue, outputs) = DeviceGraph::capture(&rt, || step(&inputs))?;
        self.inputs = inputs;
        self.outputs = outputs;
        self.graph = Some((graph, prologue));
        self.captures += 1;
        Ok(())
    }
}
