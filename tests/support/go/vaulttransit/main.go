// Vault's transit secrets engine (github.com/hashicorp/vault/builtin/logical/transit,
// the code a Vault server runs for /v1/<mount>/...) behind Vault's HTTP API for the
// tests of encrypt_records' `kms: {type: vault}`.  The engine is Vault's own; this file
// is only the HTTP front a Vault server puts before it: one mount, one token (header
// X-Vault-Token; in one namespace, X-Vault-Namespace), Vault's JSON envelope and error
// shapes, storage in memory.
//
//	vaulttransit -listen 127.0.0.1:8200 -token root -mount transit [-namespace ns]
//	             [-tls-cert c -tls-key k]
//
// Prints "listening" once it accepts connections.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	hclog "github.com/hashicorp/go-hclog"
	"github.com/hashicorp/vault/builtin/logical/transit"
	"github.com/hashicorp/vault/sdk/logical"
)

type server struct {
	backend   logical.Backend
	storage   logical.Storage
	token     string
	namespace string // Vault Enterprise's: the token is valid in it alone
	prefix    string // "/v1/<mount>/"
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

func writeErrors(w http.ResponseWriter, status int, messages ...string) {
	writeJSON(w, status, map[string]any{"errors": messages})
}

func operation(r *http.Request) (logical.Operation, bool) {
	switch r.Method {
	case http.MethodGet:
		if r.URL.Query().Get("list") == "true" {
			return logical.ListOperation, true
		}
		return logical.ReadOperation, true
	case http.MethodPost, http.MethodPut:
		return logical.UpdateOperation, true
	case http.MethodDelete:
		return logical.DeleteOperation, true
	case "LIST":
		return logical.ListOperation, true
	}
	return "", false
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/sys/health" {
		writeJSON(w, http.StatusOK, map[string]any{"initialized": true, "sealed": false})
		return
	}
	token := r.Header.Get("X-Vault-Token")
	if token == "" {
		token = strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	}
	if token != s.token || r.Header.Get("X-Vault-Namespace") != s.namespace {
		writeErrors(w, http.StatusForbidden, "permission denied")
		return
	}
	if !strings.HasPrefix(r.URL.Path, s.prefix) {
		writeErrors(w, http.StatusNotFound, fmt.Sprintf("no handler for route %q", r.URL.Path))
		return
	}
	op, ok := operation(r)
	if !ok {
		writeErrors(w, http.StatusMethodNotAllowed, "unsupported operation")
		return
	}
	data := map[string]any{}
	if op == logical.UpdateOperation { // an empty body: no parameters
		if err := json.NewDecoder(r.Body).Decode(&data); err != nil && !errors.Is(err, io.EOF) {
			writeErrors(w, http.StatusBadRequest, "failed to parse JSON input: "+err.Error())
			return
		}
	}
	req := &logical.Request{
		Operation: op,
		Path:      strings.TrimPrefix(r.URL.Path, s.prefix),
		Data:      data,
		Storage:   s.storage,
	}
	ctx := r.Context()
	if op == logical.UpdateOperation {
		// Vault's router: an update of a path that checks existence creates what is absent.
		if checked, exists, err := s.backend.HandleExistenceCheck(ctx, req); err == nil &&
			checked && !exists {
			req.Operation = logical.CreateOperation
		}
	}
	resp, err := s.backend.HandleRequest(ctx, req)
	switch {
	case resp != nil && resp.IsError():
		status := http.StatusBadRequest
		if errors.Is(err, logical.ErrPermissionDenied) {
			status = http.StatusForbidden
		}
		writeErrors(w, status, resp.Error().Error())
	case errors.Is(err, logical.ErrUnsupportedPath):
		writeErrors(w, http.StatusNotFound, fmt.Sprintf("no handler for route %q", r.URL.Path))
	case errors.Is(err, logical.ErrInvalidRequest):
		writeErrors(w, http.StatusBadRequest, err.Error())
	case err != nil:
		writeErrors(w, http.StatusInternalServerError, err.Error())
	case resp == nil:
		w.WriteHeader(http.StatusNoContent)
	default:
		writeJSON(w, http.StatusOK, map[string]any{
			"request_id": fmt.Sprintf("%d", time.Now().UnixNano()), "lease_id": "",
			"renewable": false, "lease_duration": 0, "data": resp.Data,
			"wrap_info": nil, "warnings": resp.Warnings, "auth": nil,
		})
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8200", "address to listen on")
	token := flag.String("token", "root", "the one token accepted")
	mount := flag.String("mount", "transit", "the transit engine's mount path")
	namespace := flag.String("namespace", "", "the namespace the token is valid in")
	cert := flag.String("tls-cert", "", "serve HTTPS with this certificate (PEM)")
	key := flag.String("tls-key", "", "and this key (PEM)")
	flag.Parse()

	ctx := context.Background()
	storage := &logical.InmemStorage{}
	backend, err := transit.Factory(ctx, &logical.BackendConfig{
		StorageView: storage,
		Logger:      hclog.New(&hclog.LoggerOptions{Level: hclog.Warn, Output: os.Stderr}),
		System: &logical.StaticSystemView{
			DefaultLeaseTTLVal: time.Hour, MaxLeaseTTLVal: 24 * time.Hour,
		},
		BackendUUID: "gatehouse-tests",
		Config:      map[string]string{},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "transit:", err)
		os.Exit(1)
	}
	listener, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	s := &server{backend: backend, storage: storage, token: *token, namespace: *namespace,
		prefix: "/v1/" + strings.Trim(*mount, "/") + "/"}
	fmt.Println("listening")
	httpServer := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	if *cert != "" {
		err = httpServer.ServeTLS(listener, *cert, *key)
	} else {
		err = httpServer.Serve(listener)
	}
	fmt.Fprintln(os.Stderr, "serve:", err)
	os.Exit(1)
}
