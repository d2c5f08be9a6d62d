// An emulated NVRTC (libnvrtc) for the emulated driver (driver.cpp): "compiling" a kernel file
// builds it for the host as C++ with cuda/host_shim.h (MANTISSA_EMU_SHIM names it), adds a
// trampoline `NAME__launch(void** params)` per kernel that unpacks the launch's argument
// pointers by the kernel's own parameter types, and hands back the library's path as the
// "cubin". A source that does not build gives NVRTC_ERROR_COMPILATION with the compiler's
// output as the log.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

typedef int nvrtcResult;
enum { NVRTC_SUCCESS = 0, NVRTC_ERROR_INVALID_INPUT = 3, NVRTC_ERROR_COMPILATION = 6 };

struct Program {
    std::string src, name, log, cubin;
};

#define API extern "C" __attribute__((visibility("default")))

API nvrtcResult nvrtcVersion(int* major, int* minor) {
#ifdef EMU_CUDA12
    *major = 12;
#else
    *major = 13;
#endif
    *minor = 0;
    return NVRTC_SUCCESS;
}
API const char* nvrtcGetErrorString(nvrtcResult r) {
    return r == NVRTC_ERROR_COMPILATION ? "NVRTC_ERROR_COMPILATION (emulated)" : "emulated NVRTC error";
}
API nvrtcResult nvrtcCreateProgram(Program** p, const char* src, const char* name, int, const char* const*,
                                   const char* const*) {
    *p = new Program{src, name ? name : "kernel.cu", "", ""};
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcDestroyProgram(Program** p) {
    delete *p;
    *p = nullptr;
    return NVRTC_SUCCESS;
}

// Runs `cmd`, appending its output to `log`; true when it exits 0.
static bool run(const std::string& cmd, std::string& log) {
    FILE* f = popen((cmd + " 2>&1").c_str(), "r");
    if (!f) return false;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) log.append(buf, n);
    return pclose(f) == 0;
}

static bool write(const std::string& path, const std::string& text) {
    FILE* f = fopen(path.c_str(), "w");
    if (!f) return false;
    fwrite(text.data(), 1, text.size(), f);
    return fclose(f) == 0;
}

static const char* TRAMPOLINE = R"(
#include <cstddef>
#include <type_traits>
#include <utility>
template <typename... A, std::size_t... I>
static void mantissa_call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cvref_t<A>*>(p[I])...);
}
template <typename... A> static void mantissa_call(void (*f)(A...), void** p) {
    mantissa_call(f, p, std::index_sequence_for<A...>{});
}
)";

API nvrtcResult nvrtcCompileProgram(Program* p, int, const char* const*) {
    const char* shim = getenv("MANTISSA_EMU_SHIM");
    if (!shim) {
        p->log = "MANTISSA_EMU_SHIM (the path of cuda/host_shim.h) is not set";
        return NVRTC_ERROR_COMPILATION;
    }
    const char* cxx = getenv("CXX") ? getenv("CXX") : "c++";
    char dir[] = "/tmp/mantissa-emu-XXXXXX";
    if (!mkdtemp(dir)) return NVRTC_ERROR_INVALID_INPUT;
    std::string base = std::string(dir) + "/" + p->name;
    std::string text = "#include \"" + std::string(shim) + "\"\n" + p->src +
                       "\n#define MANTISSA_HOST_TAIL\n#include \"" + shim + "\"\n";
    if (!write(base + ".cpp", text)) return NVRTC_ERROR_INVALID_INPUT;
    // The kernels' names, from the preprocessed text with __global__ left as a marker.
    std::string pre;
    std::string flags = " -std=c++20 -w -x c++ ";
    if (!run(std::string(cxx) + flags + "-E -P -D__global__=MANTISSA_KERNEL " + base + ".cpp", pre)) {
        p->log = pre;
        return NVRTC_ERROR_COMPILATION;
    }
    std::string tramp = TRAMPOLINE;
    const std::string mark = "MANTISSA_KERNEL void ";
    for (size_t at = pre.find(mark); at != std::string::npos; at = pre.find(mark, at + 1)) {
        size_t s = at + mark.size(), e = s;
        while (e < pre.size() && (isalnum((unsigned char)pre[e]) || pre[e] == '_')) e++;
        std::string k = pre.substr(s, e - s);
        tramp += "extern \"C\" void " + k + "__launch(void** p) { mantissa_call(&" + k + ", p); }\n";
    }
    // Files with block barriers or warp shuffles need a block's threads to run together.
    bool coop = p->src.find("__syncthreads") != std::string::npos || p->src.find("__shfl") != std::string::npos;
    tramp += std::string("extern \"C\" int mantissa_cooperative = ") + (coop ? "1" : "0") + ";\n";
    if (!write(base + ".cpp", text + tramp)) return NVRTC_ERROR_INVALID_INPUT;
    std::string so = base + ".so";
    if (!run(std::string(cxx) + flags + "-O1 -shared -fPIC " + base + ".cpp -o " + so, p->log)) {
        return NVRTC_ERROR_COMPILATION;
    }
    p->cubin = so;
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetProgramLogSize(Program* p, size_t* n) {
    *n = p->log.size() + 1;
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetProgramLog(Program* p, char* out) {
    memcpy(out, p->log.c_str(), p->log.size() + 1);
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetCUBINSize(Program* p, size_t* n) {
    *n = p->cubin.size() + 1;
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetCUBIN(Program* p, char* out) {
    memcpy(out, p->cubin.c_str(), p->cubin.size() + 1);
    return NVRTC_SUCCESS;
}
