//! cuDNN's graph (backend) API, the part the engine uses: descriptors made, given their
//! attributes and finalized ([`Desc`]); an operation graph turned into an execution plan by
//! cuDNN's heuristics ([`Plan::build`]: mode A, then the fallback list, the first engine
//! configuration that finalizes wins, in deterministic mode the first whose engine has no
//! `NONDETERMINISTIC` numerical note); a plan run on a variant pack of device addresses
//! ([`Plan::execute`]). cudarc wraps none of this safely, so this file holds the raw calls.
//!
//! A graph cuDNN cannot run (no engine, or none that finalizes for these operands) is
//! [`Built::Declined`], not an error: the caller runs the unfused operations instead.

use crate::backend::spec::ConvDims;
use crate::{Device, Error, Result};
use cudarc::cudnn::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

pub(super) use sys::cudnnBackendAttributeName_t as Attr;
pub(super) use sys::cudnnBackendAttributeType_t as Ty;
pub(super) use sys::cudnnBackendDescriptorType_t as Kind;

const OK: sys::cudnnStatus_t = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;

/// A backend descriptor, destroyed on drop.
pub(super) struct Desc(sys::cudnnBackendDescriptor_t);

// SAFETY: a backend descriptor is plain host data owned by this value; cuDNN allows it to be
// used from any thread as long as uses do not overlap, which the owners' mutexes (the plan
// cache, the runtime's cuDNN lock) ensure.
unsafe impl Send for Desc {}
// SAFETY: as above: shared references only reach cuDNN under the runtime's cuDNN lock.
unsafe impl Sync for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `Desc::new`, destroyed once, here.
        let _ = unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

/// The status of a graph call as the error [`Desc`]'s methods return; `what` names the
/// descriptor and attribute.
fn status(what: impl FnOnce() -> String, s: sys::cudnnStatus_t) -> Result<()> {
    if s == OK {
        return Ok(());
    }
    Err(Error::CudaLibraryStatus {
        lib: "cuDNN",
        op: "cudnn graph",
        device: Device::Cpu,
        status: format!("{s:?}"),
        what: what(),
    })
}

impl Desc {
    /// A new descriptor of `kind`, to be given its attributes.
    pub(super) fn new(kind: Kind) -> Result<Desc> {
        let mut d: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `d` is a valid place for the new descriptor's address.
        let s = unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut d) };
        status(|| format!("creating a {kind:?}"), s)?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to the `vals` of type `ty`.
    ///
    /// # Safety
    /// `T` must be the C type cuDNN reads for `ty` (i64 for `CUDNN_TYPE_INT64`, f32 for
    /// `CUDNN_TYPE_FLOAT`, a `cudnnBackendDescriptor_t` for `CUDNN_TYPE_BACKEND_DESCRIPTOR`,
    /// the enum's `u32` for an enum type, and so on).
    unsafe fn set_raw<T>(&self, name: Attr, ty: Ty, vals: &[T]) -> Result<()> {
        // SAFETY: `vals` holds `vals.len()` values of the type `ty` names (the caller's
        // contract); cuDNN copies them before returning.
        let s = unsafe {
            sys::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                vals.len() as i64,
                vals.as_ptr() as *const c_void,
            )
        };
        status(|| format!("setting {name:?}"), s)
    }

    /// Sets an `INT64` attribute.
    pub(super) fn ints(&self, name: Attr, vals: &[i64]) -> Result<()> {
        // SAFETY: i64 is CUDNN_TYPE_INT64's C type.
        unsafe { self.set_raw(name, Ty::CUDNN_TYPE_INT64, vals) }
    }

    /// Sets a `FLOAT` attribute (a scalar such as a convolution's alpha).
    pub(super) fn float(&self, name: Attr, v: f32) -> Result<()> {
        // SAFETY: f32 is CUDNN_TYPE_FLOAT's C type.
        unsafe { self.set_raw(name, Ty::CUDNN_TYPE_FLOAT, &[v]) }
    }

    /// Sets a `BOOLEAN` attribute (C `bool`, one byte).
    pub(super) fn boolean(&self, name: Attr, v: bool) -> Result<()> {
        // SAFETY: Rust's bool has C's bool layout, CUDNN_TYPE_BOOLEAN's type.
        unsafe { self.set_raw(name, Ty::CUDNN_TYPE_BOOLEAN, &[v]) }
    }

    /// Sets an attribute of a `repr(u32)` enum type `ty` (data type, modes).
    pub(super) fn enumerated<E: Copy>(&self, name: Attr, ty: Ty, v: E) -> Result<()> {
        debug_assert_eq!(std::mem::size_of::<E>(), 4);
        // SAFETY: the enums cuDNN reads are C enums (4 bytes, as asserted), passed as the
        // bindings declare them.
        unsafe { self.set_raw(name, ty, &[v]) }
    }

    /// Sets a `BACKEND_DESCRIPTOR` attribute to `descs`.
    pub(super) fn descs(&self, name: Attr, descs: &[&Desc]) -> Result<()> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        // SAFETY: descriptor handles are CUDNN_TYPE_BACKEND_DESCRIPTOR's C type; each is
        // alive (borrowed) for the call.
        unsafe { self.set_raw(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw) }
    }

    /// Sets the `HANDLE` attribute.
    pub(super) fn handle(&self, name: Attr, h: sys::cudnnHandle_t) -> Result<()> {
        // SAFETY: a cudnnHandle_t is CUDNN_TYPE_HANDLE's C type; the handle is alive.
        unsafe { self.set_raw(name, Ty::CUDNN_TYPE_HANDLE, &[h]) }
    }

    /// Sets a `VOID_PTR` attribute (device addresses, a workspace).
    pub(super) fn pointers(&self, name: Attr, ptrs: &[*mut c_void]) -> Result<()> {
        // SAFETY: `void*` is CUDNN_TYPE_VOID_PTR's C type; cuDNN copies the addresses.
        unsafe { self.set_raw(name, Ty::CUDNN_TYPE_VOID_PTR, ptrs) }
    }

    /// Finalizes the descriptor; `Err` with cuDNN's status where it refuses.
    pub(super) fn finalize(&self) -> std::result::Result<(), sys::cudnnStatus_t> {
        // SAFETY: the descriptor is alive.
        match unsafe { sys::cudnnBackendFinalize(self.0) } {
            OK => Ok(()),
            s => Err(s),
        }
    }

    /// Reads one `INT64` attribute.
    fn get_int(&self, name: Attr) -> Result<i64> {
        let (mut v, mut n) = (0i64, 0i64);
        // SAFETY: room for one i64, as requested.
        let s = unsafe {
            sys::cudnnBackendGetAttribute(
                self.0,
                name,
                Ty::CUDNN_TYPE_INT64,
                1,
                &mut n,
                &mut v as *mut i64 as *mut c_void,
            )
        };
        status(|| format!("reading {name:?}"), s)?;
        Ok(v)
    }
}

/// A tensor descriptor ([`strided`]): `dims` in NCHW order (`[1, c, 1, 1]` for a per-channel
/// operand) with their dense channels-last strides; `virt`: an intermediate never in memory.
pub(super) fn tensor(
    dtype: sys::cudnnDataType_t,
    dims: [i64; 4],
    uid: i64,
    virt: bool,
) -> Result<Desc> {
    let role = if virt { Role::Virtual } else { Role::Memory };
    strided(dtype, &dims, &nhwc_strides(dims), uid, role)
}

/// Where a tensor's values live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// In device memory: the variant pack gives its address.
    Memory,
    /// An intermediate that never reaches memory (no address in the variant pack).
    Virtual,
    /// A scalar the variant pack gives by a host address, read at every execution.
    ByValue,
}

/// A tensor descriptor of any rank: `dims` with their element `strides`, the data type, the
/// id the variant pack names it by, 16-byte alignment (what the tensor-core engines ask for;
/// the caller checks the addresses), and where its values live.
pub(super) fn strided(
    dtype: sys::cudnnDataType_t,
    dims: &[i64],
    strides: &[i64],
    uid: i64,
    role: Role,
) -> Result<Desc> {
    let t = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.enumerated(
        Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
        Ty::CUDNN_TYPE_DATA_TYPE,
        dtype,
    )?;
    t.ints(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, dims)?;
    t.ints(Attr::CUDNN_ATTR_TENSOR_STRIDES, strides)?;
    t.ints(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
    t.ints(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
    t.boolean(Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, role == Role::Virtual)?;
    if role == Role::ByValue {
        t.boolean(Attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
    }
    t.finalize().map_err(|s| Error::CudaLibrary {
        lib: "cuDNN",
        msg: format!("a tensor descriptor {dims:?} strides {strides:?}: {s:?}"),
    })?;
    Ok(t)
}

/// A finalized pointwise descriptor: `mode` computed in `prec`, with `axis` for GEN_INDEX.
pub(super) fn pointwise_desc(
    mode: sys::cudnnPointwiseMode_t,
    prec: sys::cudnnDataType_t,
    axis: Option<i64>,
) -> Result<Desc> {
    let pw = Desc::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
    pw.enumerated(
        Attr::CUDNN_ATTR_POINTWISE_MODE,
        Ty::CUDNN_TYPE_POINTWISE_MODE,
        mode,
    )?;
    pw.enumerated(
        Attr::CUDNN_ATTR_POINTWISE_MATH_PREC,
        Ty::CUDNN_TYPE_DATA_TYPE,
        prec,
    )?;
    if let Some(axis) = axis {
        pw.ints(Attr::CUDNN_ATTR_POINTWISE_AXIS, &[axis])?;
    }
    pw.finalize().map_err(|s| Error::CudaLibrary {
        lib: "cuDNN",
        msg: format!("a pointwise descriptor {mode:?}: {s:?}"),
    })?;
    Ok(pw)
}

/// The dense channels-last strides of `[n, c, h, w]`, in NCHW order of the dims.
fn nhwc_strides([_, c, h, w]: [i64; 4]) -> [i64; 4] {
    [h * w * c, 1, w * c, c]
}

/// The activation, weight and output dims of `d`, in NCHW order: x, w, y.
pub(super) fn conv_dims(d: &ConvDims) -> [[i64; 4]; 3] {
    let i = |v: usize| v as i64;
    [
        [i(d.n), i(d.c), i(d.h), i(d.w)],
        [i(d.o), i(d.c), i(d.kh), i(d.kw)],
        [i(d.n), i(d.o), i(d.ho), i(d.wo)],
    ]
}

/// The convolution descriptor of `d` (cross-correlation, f32 accumulation, one group), or
/// what cuDNN said refusing it.
pub(super) fn convolution(d: &ConvDims) -> Result<std::result::Result<Desc, String>> {
    let i = |v: usize| v as i64;
    let p = &d.p;
    let conv = Desc::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.enumerated(
        Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        Ty::CUDNN_TYPE_DATA_TYPE,
        sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    )?;
    conv.enumerated(
        Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        Ty::CUDNN_TYPE_CONVOLUTION_MODE,
        sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
    )?;
    conv.ints(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?;
    let pad = [i(p.padding[0]), i(p.padding[1])];
    conv.ints(Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &pad)?;
    conv.ints(Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &pad)?;
    conv.ints(
        Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS,
        &[i(p.dilation[0]), i(p.dilation[1])],
    )?;
    conv.ints(
        Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
        &[i(p.stride[0]), i(p.stride[1])],
    )?;
    Ok(conv
        .finalize()
        .map(|()| conv)
        .map_err(|s| format!("the convolution descriptor: {s:?}")))
}

/// Finalizes an operation descriptor; `Err` with what cuDNN said, for [`Built::Declined`].
pub(super) fn op_ready(op: &Desc, what: &str) -> std::result::Result<(), String> {
    op.finalize().map_err(|s| format!("{what}: {s:?}"))
}

/// Everything a convolution graph's plan depends on: the device (its handle), the problem,
/// and whether only deterministic engines may run it (`conv::set_cudnn_deterministic`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct ConvKey {
    device: Device,
    dims: [usize; 9],
    params: [usize; 7],
    deterministic: bool,
}

impl ConvKey {
    /// The key of `d` on `device` under the deterministic switch as it is now.
    pub(super) fn new(device: Device, d: &ConvDims) -> ConvKey {
        let (dims, params) = d.key();
        ConvKey {
            device,
            dims,
            params,
            deterministic: super::conv::cudnn_deterministic(),
        }
    }

    /// Whether the plan must run on a deterministic engine.
    pub(super) fn deterministic(&self) -> bool {
        self.deterministic
    }
}

/// What running a plan for `key` gave (`Plan::execute`): `Ok(true)` it ran; `Ok(false)` cuDNN
/// refused these operands when it came to run them (`CUDNN_STATUS_NOT_SUPPORTED`), and the
/// graph is now remembered as declined, so the caller runs the unfused operations; `Err` with
/// cuDNN's status otherwise.
pub(super) fn ran<K: PlanKey>(
    plans: &Plans<K>,
    key: &K,
    what: &str,
    run: std::result::Result<(), String>,
) -> std::result::Result<bool, String> {
    match run {
        Ok(()) => Ok(true),
        Err(status) if status.contains("NOT_SUPPORTED") => {
            if std::env::var_os("MANTISSA_DEBUG_FUSION").is_some() {
                eprintln!("mantissa: cuDNN refused to run {what} for {key:?}: {status}");
            }
            let mut map = plans.lock().unwrap_or_else(|e| e.into_inner());
            map.insert(key.clone(), None);
            Ok(false)
        }
        Err(status) => Err(status),
    }
}

/// What a plan cache is keyed by: the problem and everything else the plan depends on.
pub(super) trait PlanKey: std::hash::Hash + Eq + Clone + std::fmt::Debug {}
impl<K: std::hash::Hash + Eq + Clone + std::fmt::Debug> PlanKey for K {}

/// One graph's plans by problem; `None`: cuDNN declined the problem (not asked again).
pub(super) type Plans<K = ConvKey> = Mutex<HashMap<K, Option<Arc<Plan>>>>;

/// What the cache holds for `key`: `Some(None)` where cuDNN declined it.
pub(super) fn cached<K: PlanKey>(plans: &Plans<K>, key: &K) -> Option<Option<Arc<Plan>>> {
    plans
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(key)
        .cloned()
}

/// The plan for `key`: the cached one, or the one `build` makes (on the handle the caller
/// holds), remembered either way; `None` where cuDNN declined the graph (`what` names it in
/// what `MANTISSA_DEBUG_FUSION` prints).
pub(super) fn plan_for<K: PlanKey>(
    plans: &Plans<K>,
    key: &K,
    what: &str,
    build: impl FnOnce() -> Result<Built>,
) -> Result<Option<Arc<Plan>>> {
    if let Some(known) = cached(plans, key) {
        return Ok(known);
    }
    if crate::capture::active() {
        return Err(crate::capture::refuse(
            format!("building a cuDNN plan for {what} at its first use"),
            "finalizing a plan may compile and load kernels, which a capture does not allow; \
             the step's eager warm-up calls build it",
        ));
    }
    let plan = match build()? {
        Built::Plan(plan) => Some(Arc::new(plan)),
        Built::Declined(why) => {
            if std::env::var_os("MANTISSA_DEBUG_FUSION").is_some() {
                eprintln!("mantissa: cuDNN declined {what} for {key:?}: {why}");
            }
            None
        }
    };
    let mut map = plans.lock().unwrap_or_else(|e| e.into_inner());
    map.insert(key.clone(), plan.clone());
    Ok(plan)
}

/// What [`Plan::build`] gives.
pub(super) enum Built {
    Plan(Plan),
    /// cuDNN has no engine that runs the graph for these operands; with its last status.
    Declined(String),
}

/// A finalized execution plan with its workspace size, holding every descriptor it was
/// built from (cuDNN's plan refers to the graph's descriptors).
pub(super) struct Plan {
    plan: Desc,
    pub(super) workspace: usize,
    /// Its engine carries the numerical note `NONDETERMINISTIC` (named in the profiler's
    /// label of its runs).
    pub(super) nondeterministic: bool,
    _keep: Vec<Desc>,
}

impl Plan {
    /// Builds the operation graph of the last `ops` descriptors of `descs` (the ones before
    /// are the tensors and others they refer to) on handle `h`, and the first execution
    /// plan that finalizes among the engine configurations cuDNN's heuristics list (mode A,
    /// then the fallback list). With `deterministic`, a configuration whose engine carries
    /// the numerical note `NONDETERMINISTIC` (it adds with atomics), or whose notes cannot be
    /// read, is skipped, as PyTorch's `cudnn.deterministic` filters them; the graph is
    /// declined when no other one runs it.
    pub(super) fn build(
        h: sys::cudnnHandle_t,
        descs: Vec<Desc>,
        ops: usize,
        deterministic: bool,
    ) -> Result<Built> {
        let graph = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.handle(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, h)?;
        let first = descs.len().saturating_sub(ops);
        let op_refs: Vec<&Desc> = descs[first..].iter().collect();
        graph.descs(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &op_refs)?;
        if let Err(s) = graph.finalize() {
            return Ok(Built::Declined(format!("the operation graph: {s:?}")));
        }
        let mut last = String::from("no engine configuration");
        for mode in [
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let heur = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
            heur.descs(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&graph])?;
            heur.enumerated(
                Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
                Ty::CUDNN_TYPE_HEUR_MODE,
                mode,
            )?;
            if let Err(s) = heur.finalize() {
                last = format!("heuristics {mode:?}: {s:?}");
                continue;
            }
            for cfg in configs(&heur)? {
                let nondet = nondeterministic(&cfg);
                if deterministic {
                    match &nondet {
                        Ok(false) => {}
                        Ok(true) => {
                            last = format!("only non-deterministic engines ({mode:?})");
                            continue;
                        }
                        Err(e) => {
                            last = format!("an engine's numerical notes ({mode:?}): {e}");
                            continue;
                        }
                    }
                }
                let plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.handle(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, h)?;
                plan.descs(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&cfg])?;
                match plan.finalize() {
                    Ok(()) => {
                        let ws = plan.get_int(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
                        let mut keep = descs;
                        keep.extend([graph, heur, cfg]);
                        return Ok(Built::Plan(Plan {
                            plan,
                            workspace: usize::try_from(ws).unwrap_or(0),
                            nondeterministic: matches!(nondet, Ok(true)),
                            _keep: keep,
                        }));
                    }
                    Err(s) => last = format!("an execution plan ({mode:?}): {s:?}"),
                }
            }
        }
        Ok(Built::Declined(last))
    }

    /// Runs the plan on handle `h` (whose stream orders the buffers' uses) over the device
    /// addresses `ptrs` of the tensors `uids` and a workspace of at least `self.workspace`
    /// bytes at `ws`.
    ///
    /// # Safety
    /// Each address must hold the tensor its uid names in the graph (its dims, strides and
    /// data type), on the handle's device, alive until the stream has run the plan; `ws`
    /// likewise for the workspace.
    pub(super) unsafe fn execute(
        &self,
        h: sys::cudnnHandle_t,
        uids: &[i64],
        ptrs: &[*mut c_void],
        ws: *mut c_void,
    ) -> std::result::Result<(), String> {
        let pack =
            Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR).map_err(|e| e.to_string())?;
        let set = || -> Result<()> {
            pack.ints(Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids)?;
            pack.pointers(Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, ptrs)?;
            pack.pointers(Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[ws])
        };
        set().map_err(|e| e.to_string())?;
        pack.finalize()
            .map_err(|s| format!("the variant pack: {s:?}"))?;
        // SAFETY: the plan and the pack are finalized; the addresses are the caller's.
        match unsafe { sys::cudnnBackendExecute(h, self.plan.0, pack.0) } {
            OK => Ok(()),
            s => Err(format!("{s:?}")),
        }
    }
}

/// Whether the engine of configuration `cfg` (as the heuristics filled it in) carries the
/// numerical note `NONDETERMINISTIC`; `Err` where cuDNN does not say.
fn nondeterministic(cfg: &Desc) -> Result<bool> {
    use sys::cudnnBackendNumericalNote_t as Note;
    let engine = Desc::new(Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    let (mut raw, mut n) = (engine.0, 0i64);
    // SAFETY: room for one descriptor, the created engine descriptor cuDNN copies the
    // configuration's engine into.
    let s = unsafe {
        sys::cudnnBackendGetAttribute(
            cfg.0,
            Attr::CUDNN_ATTR_ENGINECFG_ENGINE,
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            1,
            &mut n,
            &mut raw as *mut sys::cudnnBackendDescriptor_t as *mut c_void,
        )
    };
    status(|| "reading an engine configuration's engine".into(), s)?;
    // The notes as their C enum's values (u32), so that a value these bindings do not name
    // is still a valid one to hold.
    let mut notes = [u32::MAX; Note::CUDNN_NUMERICAL_NOTE_TYPE_COUNT as usize];
    let mut got = 0i64;
    // SAFETY: room for `notes.len()` enum values, as requested.
    let s = unsafe {
        sys::cudnnBackendGetAttribute(
            engine.0,
            Attr::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
            Ty::CUDNN_TYPE_NUMERICAL_NOTE,
            notes.len() as i64,
            &mut got,
            notes.as_mut_ptr() as *mut c_void,
        )
    };
    status(|| "reading an engine's numerical notes".into(), s)?;
    let got = got.clamp(0, notes.len() as i64) as usize;
    Ok(notes[..got].contains(&(Note::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32)))
}

/// The engine configurations the finalized heuristics `heur` lists, best first.
fn configs(heur: &Desc) -> Result<Vec<Desc>> {
    let mut n = 0i64;
    // SAFETY: a count query: no elements requested, none written.
    let s = unsafe {
        sys::cudnnBackendGetAttribute(
            heur.0,
            Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            0,
            &mut n,
            std::ptr::null_mut(),
        )
    };
    status(|| "counting the heuristics' results".into(), s)?;
    let cfgs = (0..n.clamp(0, 64))
        .map(|_| Desc::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>>>()?;
    if cfgs.is_empty() {
        return Ok(cfgs);
    }
    let mut raw: Vec<sys::cudnnBackendDescriptor_t> = cfgs.iter().map(|d| d.0).collect();
    let mut got = 0i64;
    // SAFETY: `raw` holds `raw.len()` created ENGINECFG descriptors for cuDNN to fill.
    let s = unsafe {
        sys::cudnnBackendGetAttribute(
            heur.0,
            Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            raw.len() as i64,
            &mut got,
            raw.as_mut_ptr() as *mut c_void,
        )
    };
    status(|| "reading the heuristics' results".into(), s)?;
    let mut cfgs = cfgs;
    cfgs.truncate(got.clamp(0, n) as usize);
    Ok(cfgs)
}
